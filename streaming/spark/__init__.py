"""Everything that knows Spark's internals or version: the session, the JVM seam, the Spark 3.5 keyed
binding, file systems and a standalone cluster. A Spark upgrade changes this folder."""
