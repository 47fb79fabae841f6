"""Workers that share a pipeline's sources over NATS JetStream (docs/fleet.md)."""
