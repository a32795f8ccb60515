"""The one error catalog of lakestream.

Every error a user can cause (bad configuration, bad CLI input, a missing prerequisite) is a
subclass of :class:`LakestreamError` whose message is one line that names the problem and the
fix. The CLI prints that line and exits with status 2; it never shows a JVM stack trace.
JVM/Py4J errors are translated at the boundary by :func:`translate_jvm_error`.
"""

from __future__ import annotations


class LakestreamError(Exception):
    """Base of every user-facing error: the message is one line with the fix."""

    exit_code = 2


class ConfigError(LakestreamError):
    """A settings value (environment or YAML) is missing or invalid."""


class JavaNotFoundError(LakestreamError):
    """No usable Java runtime (Spark 3.5 needs Java 17)."""


class IcebergJarNotFoundError(LakestreamError):
    """The Iceberg Spark runtime jar could not be resolved."""


class UnknownJobError(LakestreamError):
    """A job name that is not in the registry."""


class ProjectError(LakestreamError):
    """A user project that does not import or whose declarations do not fit together."""


class DateRangeError(LakestreamError):
    """A bad --start/--end range."""


class DeclarationError(LakestreamError):
    """A job declaration violates a rule (validated at construction)."""


class CheckpointCorruptError(LakestreamError):
    """A checkpoint folder is unreadable or inconsistent."""


class IncompatibleStateError(LakestreamError):
    """A checkpoint or savepoint was written by a different shape of the job."""


class SavepointError(LakestreamError):
    """A savepoint cannot be created, found or restored."""


class OwnershipError(LakestreamError):
    """A backfill range reaches into windows the live stream may still write."""


class LeaseHeldError(LakestreamError):
    """Another process holds the job's checkpoint (a stream, a savepoint, a restore, a forced backfill)."""


class LeaseLostError(LakestreamError):
    """This process no longer holds the job's checkpoint (another took it over): it must not commit."""


class SinkCommitError(LakestreamError):
    """A table commit failed; the batch is not acknowledged and will be replayed."""


class EngineError(LakestreamError):
    """A Spark/JVM failure, translated to one line."""


def translate_jvm_error(exc: BaseException) -> LakestreamError | None:
    """Turn a Py4J/PySpark exception into a one-line :class:`EngineError`, or None."""
    name = type(exc).__name__
    if name not in {
        "Py4JJavaError",
        "Py4JError",
        "AnalysisException",
        "StreamingQueryException",
        "IllegalArgumentException",
        "PySparkException",
        "SparkConnectException",
    } and not type(exc).__module__.startswith(("pyspark", "py4j")):
        return None
    text = str(exc).strip()
    first = next((line.strip() for line in text.splitlines() if line.strip()), name)
    # Py4J puts "An error occurred while calling o123.method." first: the cause is on the next line.
    if first.startswith("An error occurred while calling"):
        rest = [line.strip() for line in text.splitlines()[1:] if line.strip()]
        first = rest[0] if rest else first
    if len(first) > 300:
        first = first[:297] + "..."
    return EngineError(f"Spark failed: {first}")
