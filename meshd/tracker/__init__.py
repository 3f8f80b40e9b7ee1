"""Tracker duties: shard placement and route selection, as pure functions over the gossip view."""
