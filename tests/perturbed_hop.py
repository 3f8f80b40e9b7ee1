"""``meshd`` whose weights of one layer differ a little from its files: after its shard loads (and
has checked every tensor against the manifest, so its compat key is still the honest one), the MLP
down-projection of layer :data:`PERTURBED_LAYER` is nudged by a small deterministic noise. This is
a peer whose memory, conversion or kernels went wrong under a card that says all is well. Run as
``python -m`` with ``meshd run``'s arguments, by the tests that check trace parity names the layer."""

from __future__ import annotations

import torch

from meshd.cli.meshd_main import main
from meshd.runtime.shard import Shard

PERTURBED_LAYER = 2
PERTURBED_TENSOR = "mlp.down_proj.weight"
SCALE = 0.05  # of the tensor's own standard deviation

_honest_load = Shard._load


def perturb(shard: Shard, layer: int = PERTURBED_LAYER, tensor: str = PERTURBED_TENSOR, scale: float = SCALE) -> None:
    """Add noise of ``scale`` times its standard deviation to one tensor of one layer of ``shard``."""
    weight = shard.layers[layer - shard.spec.start].get_parameter(tensor)
    noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(layer), dtype=torch.float32)
    with torch.no_grad():
        weight.add_((noise * scale * weight.float().std()).to(weight.dtype))


def _perturbed_load(self, index):  # type: ignore[no-untyped-def]
    _honest_load(self, index)
    if self.spec.start <= PERTURBED_LAYER < self.spec.end:
        perturb(self)


if __name__ == "__main__":  # only in the daemon this module runs as: importing it changes nothing
    Shard._load = _perturbed_load  # type: ignore[method-assign]
    main()
