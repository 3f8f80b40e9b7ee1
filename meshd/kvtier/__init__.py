"""The KV tier: memory peers lend to hold the prefix KV hops keep, for a hop that lost its own copy."""
