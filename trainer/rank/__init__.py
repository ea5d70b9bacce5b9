"""Inside a rank process (torch): the rank's start, one run from setup to result, and a warm job's rank."""
