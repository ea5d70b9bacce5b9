"""After-search stages that take a study and a runner: the finalists' confirmation, the worst-case probe."""
