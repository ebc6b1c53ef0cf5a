"""Request and response schemas: ragblend's own endpoints (ragblend.py), OpenAI's (openai.py), Anthropic's
(anthropic.py). Pydantic models only: the rules of text from outside are app.validation's."""
