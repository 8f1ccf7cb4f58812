"""The benchmark behind `flash-hopper bench`, one role per module.

cases (the sweep) -> registry (backends by name: base's interface, implemented by backends for
flash-hopper's paths and by peers for SDPA, flex and FA packages) -> timing (how) -> check (is it
right) -> runner (the loop) -> report/plot (tables, JSON, CSV, PNG) with env (where it ran), flops
and peak (what the numbers mean). info and demo back the other two subcommands. Imports go one way:
base <- backends, peers <- registry, so no module imports its importer.
"""
