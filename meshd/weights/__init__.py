"""A model's weights shared between peers: a peer given only a model's name fetches the tensors of the
layers placed on it from peers that hold them, each chunk checked against hashes the compat key
commits to (:mod:`meshd.weights.fetch`), and every peer hands out what it holds
(:mod:`meshd.weights.source`)."""
