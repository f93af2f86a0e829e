"""Small shared helpers: atomic files, hashing, performance measurement."""
