"""Messages on lbd's wires (standard library and msgspec only)."""
