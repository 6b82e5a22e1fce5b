"""The daemon's HTTP face: OpenAI-, Ollama- and llama.cpp-compatible endpoints that turn
HTTP requests into the same `Submit`s the socket protocol carries (see
llmd.actors.http_intake for the listener that serves them)."""
