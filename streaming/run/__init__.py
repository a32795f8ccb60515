"""Running a job as a stream: the runner, the exactly-once commit of each micro-batch, fault points."""
