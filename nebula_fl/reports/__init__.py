"""What a person reads after a run: the privacy report of a run folder or a cluster's state folder, and the
figures (privacy spent, metric against WAN bytes). Apart from the privacy maths, which never draws."""
