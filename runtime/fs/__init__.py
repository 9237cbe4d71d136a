"""File access that follows nothing it should not: openat2, fd-relative trees, owners, the page cache."""
