"""What the engine asks of the machine it runs on: optional packages (packages.py) and CPU
threads (threads.py). Imports nothing of tinypaged, so every layer may use it."""
