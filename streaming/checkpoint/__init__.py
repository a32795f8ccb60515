"""A job's checkpoint: its file layout, the batch records and incremental store kept in it, inspection
and health without a JVM, savepoints and the compatibility guard."""
