# streamapp GPU worker: TensorRT 10 + CUDA from NVIDIA's container, streamapp on top.
# Build from the repository root: docker compose build worker
FROM nvcr.io/nvidia/tensorrt:24.12-py3

WORKDIR /opt/streamapp
COPY pyproject.toml README.md ./
COPY streamapp ./streamapp
COPY engines ./engines
RUN python -m pip install --no-cache-dir '.[gpu]'

ENV STREAMAPP_WEB_BIND=0.0.0.0 \
    PYTHONUNBUFFERED=1
EXPOSE 6066
ENTRYPOINT ["streamapp"]
CMD ["worker"]
