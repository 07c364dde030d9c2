"""`nebula-fl run`: a whole federation on one machine, with the real Flower commands."""
