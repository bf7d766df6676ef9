"""turbospark: a local LLM inference server speaking the OpenAI, Anthropic and Ollama APIs."""

__version__ = "0.1.0"
