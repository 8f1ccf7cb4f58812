"""The benchmark behind `flash-hopper bench`, one role per module.

cases (the sweep) -> backends/peers (what is timed) -> timing (how) -> check (is it right)
-> runner (the loop) -> report/plot (tables, JSON, CSV, PNG) with env (where it ran), flops and
peak (what the numbers mean). info and demo back the other two subcommands.
"""
