"""The one engine model (vLLM v1-like), driven in real time by the simulated worker and in virtual time by
the simulator. No sockets, threads or sleeps in here."""
