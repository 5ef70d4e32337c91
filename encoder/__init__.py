"""vlmserve: encoder."""
