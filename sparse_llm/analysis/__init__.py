"""Reading what runs wrote: metrics, sweeps, plots."""
