"""Model implementations over paged attention."""
