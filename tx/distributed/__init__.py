"""Multi-host SPMD: process 0 broadcasts every backend call to the workers over a control channel, all
hosts agree on each call's outcome, and dead or hung workers are detected within a bound."""
