"""How a trial runs and is measured: a subprocess (cold), a warm job, verl, a replay; memory from outside."""
