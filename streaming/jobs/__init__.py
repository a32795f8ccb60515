"""The built-in example project: payments and logins (``sources.py``) and the fraud jobs, one module per
job, each defining ``JOB``. It runs when the settings name no project of the user's (``make demo``
shows it); the registry of whichever project runs is ``streaming.project``."""
