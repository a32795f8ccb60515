"""Input and output: reading sources, parsing and validating records, the job tables and their sinks."""
