"""The worker pool's job queue."""
