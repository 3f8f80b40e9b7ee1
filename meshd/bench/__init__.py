"""``meshctl bench``: the mesh against one process, on the same model, prompt, dtype and threads.

``workload`` builds the fixed prompt and times streamed API requests, ``baseline`` runs the model in
this process with transformers, ``runner`` starts meshes of 1..k peers on loopback and measures them,
``report`` assembles the JSON object of docs' benchmark figures and the summary table.
"""
