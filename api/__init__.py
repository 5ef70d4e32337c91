"""vlmserve: api."""
