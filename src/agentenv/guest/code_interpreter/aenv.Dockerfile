# The code-interpreter template: the server the e2b-code-interpreter SDK talks to on port 49999
# (server.py + kernel.py beside this file, standard library only), on the default Debian image.
# Build it once on a running server (the name is the SDK's default template):
#   aenv template build --name code-interpreter-v1 \
#       -f src/agentenv/guest/code_interpreter/aenv.Dockerfile src/agentenv/guest/code_interpreter
# The build snapshots the VM after the ready check, so every sandbox starts with the server and
# its default Python context already warm.
FROM base
USER root
RUN mkdir -p /opt/code-interpreter
COPY server.py /opt/code-interpreter/server.py
COPY kernel.py /opt/code-interpreter/kernel.py
COPY supervise.sh /opt/code-interpreter/supervise.sh
RUN chmod 755 /opt/code-interpreter/supervise.sh
USER user
WORKDIR /home/user
# As E2B's, the server runs as root (kernels run as root, in /home/user); a crash restarts it.
START_CMD sudo /opt/code-interpreter/supervise.sh
READY_CMD curl -sf http://127.0.0.1:49999/health
