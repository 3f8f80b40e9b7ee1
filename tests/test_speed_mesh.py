"""Speed claims among real daemons: a peer whose card claims its layers decode ten million tokens a
second draws the first route, is timed on that first use and demoted (avoided while an honest
holder of the same layers covers them), and the mesh goes on through that holder, whose claim the
timing bears out."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshd.daemon.local_mesh import LocalMesh
from tests.boastful_hop import BOAST_TOK_S
from tests.helpers import api_chat, chat_reference, metric_total

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
QUESTION = "How fast are you?"


def speed_of(observer, peer_id: str) -> tuple[dict | None, str | None]:
    row = next(p for p in observer.get("/peers")["peers"] if p["peer_id"] == peer_id)
    return row["speed"], row["demoted"]


def test_a_peer_claiming_a_speed_it_does_not_have_is_timed_on_first_use_and_demoted(tiny_model, tmp_path):
    with LocalMesh(tmp_path, env={"PYTHONPATH": str(REPO)}) as mesh:
        entry = mesh.start_peer(model=tiny_model, layers=(0, 2))
        boaster = mesh.start_peer(model=tiny_model, layers=(2, 4), module="tests.boastful_hop")
        honest = mesh.start_peer(model=tiny_model, layers=(2, 4))
        mesh.wait_covered("tiny", timeout=60)
        route = entry.get("/route?model=tiny")
        assert [h["peer_id"] for h in route["hops"]][1] == boaster.peer_id, "the boast draws the first route"

        reference = chat_reference(tiny_model, QUESTION, 8)
        assert api_chat(entry, QUESTION, 8, ignore_eos=True) == reference  # slow, but right
        speed, demoted = mesh.wait_until(lambda: (s := speed_of(entry, boaster.peer_id))[0] and s, 60,
                                         "the boaster's speed check")
        print(f"\nboaster: claims {speed['claimed_tok_s']} tok/s, measured {speed['measured_tok_s']}")
        assert speed["demoted"] and demoted and "claims" in demoted
        assert speed["claimed_tok_s"] == BOAST_TOK_S and speed["measured_tok_s"] * 4 < BOAST_TOK_S
        assert [h["peer_id"] for h in entry.get("/route?model=tiny")["hops"]][1] == honest.peer_id

        assert api_chat(entry, QUESTION, 8, ignore_eos=True) == reference
        speed, demoted = mesh.wait_until(lambda: (s := speed_of(entry, honest.peer_id))[0] and s, 60,
                                         "the honest peer's speed check")
        assert not speed["demoted"] and demoted is None
        sequence = lambda: next(p["sequence"] for p in entry.get("/peers")["peers"]  # noqa: E731
                                if p["peer_id"] == boaster.peer_id)
        timed_under = sequence()
        mesh.wait_until(lambda: sequence() > timed_under, 60, "a new card of the boaster")
        assert speed_of(entry, boaster.peer_id)[1], "still demoted: its new card claims as much as before"
        assert [h["peer_id"] for h in entry.get("/route?model=tiny")["hops"]][1] == honest.peer_id
        assert metric_total(entry, "meshd_speed_checks", 'verdict="demoted"') == 1
        assert metric_total(entry, "meshd_speed_checks", 'verdict="met"') == 1
        assert "demoted " + boaster.peer_id[:12] in entry.log_path.read_text()
