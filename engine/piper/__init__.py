"""The embedded CPU voice (Piper). Importing the package loads nothing heavy: the engine
itself is :mod:`tts_gateway.engine.piper.engine`, which the registry imports only when it is picked."""
