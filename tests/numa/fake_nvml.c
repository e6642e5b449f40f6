/* A stand-in for libnvidia-ml.so.1 with the calls fastelastic.numa._gpus makes, for tests.

   The GPUs come from $FAKE_NVML_GPUS, read at each nvmlInit_v2: entries separated by ';',
   each "busId,uuid,name[,mig uuid...]" (MIG on when a MIG uuid is given). $FAKE_NVML_INIT_RC
   makes nvmlInit_v2 fail with that code (9: driver not loaded); $FAKE_NVML_LOG names a file
   that gets one line per init and per shutdown. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} pci_info;

#define MAXG 16
#define MAXM 8
#define MIG_BASE 0x1000L

static int n;
static char bus[MAXG][32], uuid[MAXG][96], name[MAXG][96], mig[MAXG][MAXM][96];
static int nmig[MAXG];

static void note(const char *what) {
    const char *path = getenv("FAKE_NVML_LOG");
    FILE *f = path ? fopen(path, "a") : NULL;
    if (f) {
        fprintf(f, "%s\n", what);
        fclose(f);
    }
}

int nvmlInit_v2(void) {
    note("init");
    const char *rc = getenv("FAKE_NVML_INIT_RC");
    if (rc && atoi(rc)) return atoi(rc);
    n = 0;
    const char *spec = getenv("FAKE_NVML_GPUS");
    if (!spec) return 0;
    char buf[4096], *s1, *s2;
    snprintf(buf, sizeof buf, "%s", spec);
    for (char *g = strtok_r(buf, ";", &s1); g && n < MAXG; g = strtok_r(NULL, ";", &s1)) {
        int k = 0;
        nmig[n] = 0;
        for (char *f = strtok_r(g, ",", &s2); f; f = strtok_r(NULL, ",", &s2), k++) {
            if (k == 0) snprintf(bus[n], sizeof bus[n], "%s", f);
            else if (k == 1) snprintf(uuid[n], sizeof uuid[n], "%s", f);
            else if (k == 2) snprintf(name[n], sizeof name[n], "%s", f);
            else if (nmig[n] < MAXM) snprintf(mig[n][nmig[n]++], 96, "%s", f);
        }
        n++;
    }
    return 0;
}

int nvmlShutdown(void) { note("shutdown"); return 0; }

const char *nvmlErrorString(int rc) { return rc == 9 ? "Driver Not Loaded" : "Unknown Error"; }

int nvmlDeviceGetCount_v2(unsigned int *count) { *count = (unsigned int)n; return 0; }

int nvmlDeviceGetHandleByIndex_v2(unsigned int i, void **h) {
    if (i >= (unsigned int)n) return 2;
    *h = (void *)(long)(i + 1);
    return 0;
}

static int gpu_of(void *h) {
    long v = (long)h;
    return v < MIG_BASE ? (int)v - 1 : (int)((v - MIG_BASE) / 16);
}

static int mig_of(void *h) {
    long v = (long)h;
    return v < MIG_BASE ? -1 : (int)((v - MIG_BASE) % 16);
}

int nvmlDeviceGetPciInfo_v3(void *h, pci_info *p) {
    memset(p, 0, sizeof *p);
    snprintf(p->busId, sizeof p->busId, "%s", bus[gpu_of(h)]);
    return 0;
}

int nvmlDeviceGetUUID(void *h, char *out, unsigned int len) {
    int m = mig_of(h);
    snprintf(out, len, "%s", m < 0 ? uuid[gpu_of(h)] : mig[gpu_of(h)][m]);
    return 0;
}

int nvmlDeviceGetName(void *h, char *out, unsigned int len) {
    snprintf(out, len, "%s", name[gpu_of(h)]);
    return 0;
}

int nvmlDeviceGetMigMode(void *h, unsigned int *current, unsigned int *pending) {
    *current = *pending = nmig[gpu_of(h)] > 0;
    return 0;
}

int nvmlDeviceGetMaxMigDeviceCount(void *h, unsigned int *count) {
    (void)h;
    *count = 7;
    return 0;
}

int nvmlDeviceGetMigDeviceHandleByIndex(void *h, unsigned int j, void **out) {
    int g = gpu_of(h);
    if ((int)j >= nmig[g]) return 6; /* NVML_ERROR_NOT_FOUND: an empty slot */
    *out = (void *)(MIG_BASE + g * 16L + j);
    return 0;
}
