"""The tier: storage backends (posix, S3; ``location.open_backend`` picks one), the segment layout and
commit log, and readers."""
