"""How a failing job ends: the watchdog that names a dead or silent rank, the supervisor that names
a rank killed by a signal, and fault injection to rehearse both. Imports nothing heavy, because
the supervisor runs before torch is loaded."""
