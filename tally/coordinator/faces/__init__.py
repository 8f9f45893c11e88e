"""What the coordinator shows the world: the device API, the admin API and its token, device fronts
and the per-source rate limits. Highest room: it calls into rounds and state, never the reverse."""
