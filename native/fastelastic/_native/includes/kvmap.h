/* The store's key-value map: byte-string keys to byte-string values, open addressing.
 *
 * Why not std::unordered_map: a lookup there is a chain of dependent loads (bucket array, the
 * node before the bucket, the node, the key's heap buffer, the value's heap buffer). Once the
 * map outgrows the caches (100,000 keys) each is a miss, and none can be fetched ahead.
 * Here a lookup touches two places: the slot array (hash + entry pointer, 16 bytes, linear
 * probing, at most half full) and one entry block holding the key and the value together.
 * Both can be prefetched from the hash alone, so multi-key requests pipeline their lookups.
 * Growing rehashes only the slot array: the hashes are in the slots, entries never move.
 *
 * Invariants: capacity is a power of two; a slot is empty iff e == nullptr; every key sits in
 * the probe run starting at its home slot (hash & mask) with no empty slot in between
 * (erase shifts entries back to keep it so); size_ * 2 <= capacity.
 *
 * Pins: a reply being streamed from an entry's value pins it (pin/unpin). A pinned entry is
 * never changed in place or freed: a write makes a fresh entry and retires the old one, which
 * the last unpin frees; retired_bytes() is what such entries hold meanwhile.
 */
#ifndef FE_KVMAP_H
#define FE_KVMAP_H

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <string>
#include <string_view>

struct fe_entry {
    size_t vlen;
    size_t vcap;
    size_t klen;
    uint32_t pins;      /* replies streaming this value */
    bool retired;       /* no longer in the map: freed by the last unpin */
    char *key() { return reinterpret_cast<char *>(this + 1); }
    char *val() { return key() + klen; }
};

static inline void fe_entry_pin(fe_entry *e) { ++e->pins; }

struct fe_slot {
    uint64_t hash;
    fe_entry *e;
};

class fe_kvmap {
  public:
    fe_kvmap() { alloc_slots(kMinCapacity); }
    ~fe_kvmap() {
        clear();
        std::free(slots_);
    }
    fe_kvmap(const fe_kvmap &) = delete;
    fe_kvmap &operator=(const fe_kvmap &) = delete;

    static uint64_t hash(const char *k, size_t n) {
        return std::hash<std::string_view>{}(std::string_view(k, n));
    }

    size_t size() const { return size_; }
    size_t capacity() const { return mask_ + 1; }
    /* Slot i's entry or nullptr; with capacity(), walks every key (LIST_KEYS). */
    fe_entry *at(size_t i) const { return slots_[i].e; }

    /* First stage of a pipelined lookup: bring the key's home slot into the cache. */
    void prefetch_slot(uint64_t h) const { __builtin_prefetch(&slots_[h & mask_]); }

    /* Second stage (a few keys later, once the slot is cached): bring in the entry. */
    void prefetch_entry(uint64_t h) const {
        size_t i = h & mask_;
        for (int probes = 0; probes < 4 && slots_[i].e != nullptr; ++probes) {
            if (slots_[i].hash == h) {
                __builtin_prefetch(slots_[i].e);
                __builtin_prefetch(reinterpret_cast<char *>(slots_[i].e) + 64);
                return;
            }
            i = (i + 1) & mask_;
        }
    }

    fe_entry *find(const char *k, size_t n, uint64_t h) const {
        const fe_slot *s = probe(k, n, h);
        return s->e;
    }
    fe_entry *find(const char *k, size_t n) const { return find(k, n, hash(k, n)); }
    fe_entry *find(const std::string &k) const { return find(k.data(), k.size()); }

    /* key = value (created if missing); returns false only when out of memory. */
    bool set(const char *k, size_t n, uint64_t h, const char *v, size_t vn) {
        fe_slot *s = slot_for_write(k, n, h);
        if (s == nullptr) return false;
        if (s->e != nullptr && s->e->pins == 0 && s->e->vcap >= vn &&
            !(s->e->vcap > 256 && vn < s->e->vcap / 4)) {
            std::memcpy(s->e->val(), v, vn);
            s->e->vlen = vn;
            return true;
        }
        return replace(s, k, n, h, v, vn, vn);
    }
    bool set(const std::string &k, const char *v, size_t vn) {
        return set(k.data(), k.size(), hash(k.data(), k.size()), v, vn);
    }

    /* key += value (created if missing); capacity grows geometrically. */
    bool append(const char *k, size_t n, uint64_t h, const char *v, size_t vn) {
        fe_slot *s = slot_for_write(k, n, h);
        if (s == nullptr) return false;
        if (s->e == nullptr) return replace(s, k, n, h, v, vn, vn);
        fe_entry *e = s->e;
        if (e->pins > 0) {   /* copy on write: the streamed value stays as it was */
            size_t cap = e->vlen + vn > 2 * e->vlen ? e->vlen + vn : 2 * e->vlen;
            fe_entry *g = static_cast<fe_entry *>(std::malloc(sizeof(fe_entry) + n + cap));
            if (g == nullptr) return false;
            g->klen = n;
            g->vlen = e->vlen;
            g->vcap = cap;
            g->pins = 0;
            g->retired = false;
            std::memcpy(g->key(), k, n);
            std::memcpy(g->val(), e->val(), e->vlen);
            retire(e);
            s->e = e = g;
        }
        if (e->vcap - e->vlen < vn) {
            size_t cap = e->vcap * 2 > e->vlen + vn ? e->vcap * 2 : e->vlen + vn;
            fe_entry *g = static_cast<fe_entry *>(std::realloc(e, sizeof(fe_entry) + n + cap));
            if (g == nullptr) return false;
            g->vcap = cap;
            s->e = e = g;
        }
        std::memcpy(e->val() + e->vlen, v, vn);
        e->vlen += vn;
        return true;
    }
    bool append(const std::string &k, const char *v, size_t vn) {
        return append(k.data(), k.size(), hash(k.data(), k.size()), v, vn);
    }

    bool erase(const char *k, size_t n) {
        fe_slot *s = probe(k, n, hash(k, n));
        if (s->e == nullptr) return false;
        retire(s->e);
        --size_;
        /* Backward-shift deletion: pull later members of the run into the hole. */
        size_t hole = static_cast<size_t>(s - slots_);
        size_t j = hole;
        for (;;) {
            j = (j + 1) & mask_;
            if (slots_[j].e == nullptr) break;
            size_t home = slots_[j].hash & mask_;
            /* slot j may move to the hole iff its home is not cyclically in (hole, j] */
            bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
            if (!stays) {
                slots_[hole] = slots_[j];
                hole = j;
            }
        }
        slots_[hole].e = nullptr;
        return true;
    }

    void clear() {
        for (size_t i = 0; i <= mask_; ++i) {
            if (slots_[i].e != nullptr) retire(slots_[i].e);
            slots_[i].e = nullptr;
        }
        size_ = 0;
    }

    void unpin(fe_entry *e) {
        if (--e->pins == 0 && e->retired) {
            retired_ -= sizeof(fe_entry) + e->klen + e->vcap;
            std::free(e);
        }
    }
    size_t retired_bytes() const { return retired_; }

  private:
    static constexpr size_t kMinCapacity = 64;
    fe_slot *slots_ = nullptr;
    size_t mask_ = 0;
    size_t size_ = 0;
    size_t retired_ = 0;

    /* An entry leaves the map: freed now, or when the last reply streaming it is sent. */
    void retire(fe_entry *e) {
        if (e->pins == 0) {
            std::free(e);
            return;
        }
        e->retired = true;
        retired_ += sizeof(fe_entry) + e->klen + e->vcap;
    }

    void alloc_slots(size_t cap) {
        slots_ = static_cast<fe_slot *>(std::calloc(cap, sizeof(fe_slot)));
        if (slots_ == nullptr) throw std::bad_alloc();
        mask_ = cap - 1;
    }

    /* The key's slot, or the empty slot where it would go. */
    fe_slot *probe(const char *k, size_t n, uint64_t h) const {
        size_t i = h & mask_;
        for (;;) {
            fe_slot *s = &slots_[i];
            if (s->e == nullptr) return s;
            if (s->hash == h && s->e->klen == n && std::memcmp(s->e->key(), k, n) == 0) return s;
            i = (i + 1) & mask_;
        }
    }

    fe_slot *slot_for_write(const char *k, size_t n, uint64_t h) {
        fe_slot *s = probe(k, n, h);
        if (s->e != nullptr || (size_ + 1) * 2 <= capacity()) return s;
        if (!rehash(capacity() * 2)) return nullptr;
        return probe(k, n, h);
    }

    /* Puts a fresh entry (key, value, capacity cap) in slot s, freeing the old one. */
    bool replace(fe_slot *s, const char *k, size_t n, uint64_t h, const char *v, size_t vn,
                 size_t cap) {
        fe_entry *e = static_cast<fe_entry *>(std::malloc(sizeof(fe_entry) + n + cap));
        if (e == nullptr) return false;
        e->klen = n;
        e->vlen = vn;
        e->vcap = cap;
        e->pins = 0;
        e->retired = false;
        std::memcpy(e->key(), k, n);
        std::memcpy(e->val(), v, vn);
        if (s->e == nullptr) ++size_;
        else retire(s->e);
        s->hash = h;
        s->e = e;
        return true;
    }

    bool rehash(size_t cap) {
        fe_slot *old = slots_;
        size_t old_cap = capacity();
        fe_slot *fresh = static_cast<fe_slot *>(std::calloc(cap, sizeof(fe_slot)));
        if (fresh == nullptr) return false;
        slots_ = fresh;
        mask_ = cap - 1;
        for (size_t i = 0; i < old_cap; ++i) {
            if (old[i].e == nullptr) continue;
            size_t j = old[i].hash & mask_;
            while (slots_[j].e != nullptr) j = (j + 1) & mask_;
            slots_[j] = old[i];
        }
        std::free(old);
        return true;
    }
};

#endif
