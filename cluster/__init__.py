"""Ray Serve application: one engine replica per GPU behind one ingress serving the same API and studio.

``cluster.application.build`` assembles it (``serve deploy`` / ``python app.py --replicas N``);
``engine_replica`` holds a whole ``TTSEngine``; ``remote_engine`` is the engine-shaped object the ingress
hands to ``api/`` and ``webui/``; ``board`` is where replicas report their gauges. Needs
``requirements-cluster.txt``; nothing here is imported by the single-process server (``server/``), which
cluster/ reuses: ``app.py`` picks one or the other.
"""
