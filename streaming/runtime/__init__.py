"""What the runner (``streaming.service``) runs the queries with: the Spark session, checkpoints, the follower thread, late starts, failover, metrics, priorities."""
