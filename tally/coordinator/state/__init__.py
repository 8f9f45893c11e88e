"""What the coordinator keeps: the store (jobs, rounds, models, events, blobs) over SQLite or
PostgreSQL, algorithm states as bytes, the enrolled devices, and which replica leads."""
