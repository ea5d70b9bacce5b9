"""verl as a trial engine: the adapter that runs verl's own trainer and reads its metrics (torch-free), the
CPU shim and memory cap loaded inside verl's processes, and the preset maker."""
