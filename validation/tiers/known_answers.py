"""Known answers of a full fp32 forward on the official Kimi K3 checkpoint (K3_FACTS §6).

The correctness tier checks them when the checkpoint is the official release
(:attr:`k3rocm.validation.session.Session.is_official`).
"""

from __future__ import annotations

# ids [3, 4, 5, 6, 7]: the last position's argmax, top logit and mean logit
OFFICIAL_IDS = [3, 4, 5, 6, 7]
OFFICIAL_ARGMAX, OFFICIAL_TOP_LOGIT, OFFICIAL_MEAN_LOGIT = 2494, 15.021948, -0.462536
# max |h| after layers 0-3 and after the last layer, of the same forward
OFFICIAL_FIRST_ABSMAX = [0.145457, 0.187096, 0.463652, 1.284419]
OFFICIAL_LAST_ABSMAX = 31.064180
# "The capital of France is" and its greedy continuation
OFFICIAL_PROMPT = [1008, 10484, 318, 15383, 387]
OFFICIAL_GREEDY = [17374, 20829, 10, 427, 414, 1008, 606, 142957]
