"""How a failing job ends: the watchdog that names a dead or silent rank, the supervisor that names
a rank killed by a signal, how a failed rank ends the job (`ending`), what a non-finite step does
(`nonfinite`), and fault injection to rehearse them. Imports nothing itself, because the
supervisor runs before torch is loaded."""
