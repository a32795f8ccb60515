"""The lakestream command line and the tools a user holds: the CLI, the demo, sample data, the project
scaffold and the test harness. It sits above the engine (``streaming``), the bounded twins (``batch``) and
Dagster (``orchestration``), and nothing below imports it."""
