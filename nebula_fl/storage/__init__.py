"""What a run leaves on disk: durable writes, the run folder and its sealed checkpoints.

Low in the layers so that the server, the reports, the teacher loader and generation read one format.
"""
