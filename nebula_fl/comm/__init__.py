"""What crosses the WAN, and how much of it."""
