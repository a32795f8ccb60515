"""IoT sensor readings: a lakestream project of its own (CSV landing files, a sliding-window job and a
keyed alert). Point the settings at this folder (``project: examples/sensors``) to run it."""
