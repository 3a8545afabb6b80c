"""What this project adds to Harbor's ``docker`` backend: a Compose overlay, and the cleanup of its leftovers."""
