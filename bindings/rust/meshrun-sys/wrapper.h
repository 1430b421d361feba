/* What meshrun-sys declares: the host API and the plugin tables. */
#include "meshrun/host.h"
#include "meshrun/plugin.h"
#include "meshrun/strategy.h"
