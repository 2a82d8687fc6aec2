"""The application on top of the library: ``pipetrain train`` and the models it trains.

Nothing in ``schedule``, ``sim``, ``render`` or ``runtime`` imports this package; it imports
torch and the runtime like any user program would.
"""
