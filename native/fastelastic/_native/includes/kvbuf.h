/* A store connection's buffers, each a small type that owns its memory and knows its bounds:
 *
 * - fe_inbuf: the request a client is part-way through sending. It exists only while one is
 *   partial (most requests arrive whole and are parsed straight from the loop's read buffer),
 *   so an idle connection pays one pointer for it.
 * - fe_outbuf: the replies the kernel has not taken yet. Plain bytes are appended by the
 *   commands; a large value is not copied but streamed from the map (its entry pinned) by a
 *   gathering sendmsg, so a reply of many large values costs no copy and no second buffer.
 * - fe_budget: the server's bounds on them: when a connection's unsent replies pause its
 *   reading (and when they have drained enough to resume), and how much all connections'
 *   buffers may hold together.
 *
 * All memory is PyMem_Raw (the loop runs without the GIL) or nothrow: out of memory is a
 * result, never an exception (fe_append in wire.pxd sets fe_oom for the plain bytes).
 * The socket calls stay in KVServer; these only do the bookkeeping.
 */
#ifndef FE_KVBUF_H
#define FE_KVBUF_H

#include <Python.h>
#include <sys/uio.h>

#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "kvmap.h"

/* Where parsing a partial request stopped (see KVServer._measure): a multi-key request that
 * arrives in many reads is measured once, not once per read. */
struct fe_scan {
    size_t need = 0;     /* bytes that must be buffered before the next parse can succeed */
    size_t off = 0;      /* a partial multi-key request is measured up to here... */
    uint64_t i = 0;      /* ...and this many of its blobs */
};

class fe_inbuf {
  public:
    fe_scan scan;

    fe_inbuf() = default;
    ~fe_inbuf() { PyMem_RawFree(p_); }
    fe_inbuf(const fe_inbuf &) = delete;
    fe_inbuf &operator=(const fe_inbuf &) = delete;

    /* A new buffer holding a copy of p[0:n], or nullptr (out of memory). Only what arrived is
     * reserved: a length prefix claiming megabytes reserves nothing. */
    static fe_inbuf *holding(const char *p, size_t n, const fe_scan &scan) {
        fe_inbuf *b = new (std::nothrow) fe_inbuf();
        if (b == nullptr)
            return nullptr;
        if (!b->append(p, n)) {
            delete b;
            return nullptr;
        }
        b->scan = scan;
        return b;
    }

    char *data() { return p_; }
    size_t size() const { return len_; }
    size_t heap() const { return cap_ + sizeof(fe_inbuf); }
    bool complete() const { return len_ >= scan.need; }

    /* Room for at least want bytes, growing geometrically (realloc of a large block remaps
     * pages, it does not copy). False: out of memory, nothing changed. */
    bool reserve(size_t want) {
        if (want <= cap_)
            return true;
        size_t cap = cap_ * 2 < want ? want : cap_ * 2;
        char *grown = static_cast<char *>(PyMem_RawRealloc(p_, cap));
        if (grown == nullptr)
            return false;
        p_ = grown;
        cap_ = cap;
        return true;
    }
    bool append(const char *p, size_t n) {
        if (!reserve(len_ + n))
            return false;
        std::memcpy(p_ + len_, p, n);
        len_ += n;
        return true;
    }
    /* Direct reads: recv into tail() (room() bytes), then grew() by what arrived. */
    char *tail() { return p_ + len_; }
    size_t room() const { return cap_ - len_; }
    void grew(size_t n) { len_ += n; }
    /* The first n bytes were executed: keep only the rest. */
    void consume(size_t n) {
        std::memmove(p_, p_ + n, len_ - n);
        len_ -= n;
    }

  private:
    char *p_ = nullptr;
    size_t len_ = 0;
    size_t cap_ = 0;
};

class fe_outbuf {
  public:
    std::string bytes;   /* plain reply bytes; bytes[0:pos()] have been sent */

    fe_outbuf() = default;
    ~fe_outbuf() { delete st_; }   /* release(kv) first: it unpins what was never sent */
    fe_outbuf(const fe_outbuf &) = delete;
    fe_outbuf &operator=(const fe_outbuf &) = delete;

    size_t pos() const { return pos_; }
    size_t unsent() const { return bytes.size() - pos_ + (st_ ? st_->unsent : 0); }
    bool streaming() const { return st_ != nullptr; }
    /* heap bytes held (std::string keeps up to 15 bytes inline) */
    size_t heap() const {
        size_t h = bytes.capacity() > 15 ? bytes.capacity() : 0;
        return st_ ? h + sizeof(streamed) + st_->refs.capacity() * sizeof(ref) : h;
    }

    /* Appends a value for a reply: its length, then its bytes, copied when small and streamed
     * from the map (pinned until sent) from stream_above on. False: out of memory. */
    bool put_value(fe_entry *e, size_t stream_above) {
        uint64_t n = e->vlen;
        try {
            bytes.append(reinterpret_cast<const char *>(&n), 8);
            if (e->vlen < stream_above) {
                bytes.append(e->val(), e->vlen);
                return true;
            }
            if (st_ == nullptr)
                st_ = new streamed();
            st_->refs.push_back(ref{bytes.size(), e});
        } catch (...) {
            return false;
        }
        fe_entry_pin(e);
        st_->unsent += e->vlen;
        return true;
    }

    /* The plain bytes not sent yet (while not streaming()). */
    const char *pending() const { return bytes.data() + pos_; }
    size_t pending_size() const { return bytes.size() - pos_; }
    void sent(size_t n) { pos_ += n; }

    /* While streaming(): the next sendmsg's iovecs (plain spans and the values between them,
     * in order), at most max; returns how many. */
    int gather(struct iovec *iov, int max) const {
        int n = 0;
        size_t at = pos_, i = st_->i, off = st_->off;
        while (n < max) {
            if (i < st_->refs.size() && at == st_->refs[i].at) {
                fe_entry *e = st_->refs[i].e;
                iov[n].iov_base = e->val() + off;
                iov[n].iov_len = e->vlen - off;
                ++n;
                ++i;
                off = 0;
                continue;
            }
            size_t end = i < st_->refs.size() ? st_->refs[i].at : bytes.size();
            if (end > at) {
                iov[n].iov_base = const_cast<char *>(bytes.data()) + at;
                iov[n].iov_len = end - at;
                ++n;
                at = end;
            }
            if (i >= st_->refs.size())
                break;
        }
        return n;
    }

    /* While streaming(): n bytes of gather()'s iovecs went out. Unpins each value sent in
     * full; once every value is out, what is left is plain bytes (streaming() turns false). */
    void advance(size_t n, fe_kvmap &kv) {
        while (n > 0) {
            if (st_->i < st_->refs.size() && pos_ == st_->refs[st_->i].at) {
                fe_entry *e = st_->refs[st_->i].e;
                size_t take = e->vlen - st_->off < n ? e->vlen - st_->off : n;
                st_->off += take;
                st_->unsent -= take;
                n -= take;
                if (st_->off == e->vlen) {
                    kv.unpin(e);
                    ++st_->i;
                    st_->off = 0;
                }
            } else {
                size_t end = st_->i < st_->refs.size() ? st_->refs[st_->i].at : bytes.size();
                size_t take = end - pos_ < n ? end - pos_ : n;
                pos_ += take;
                n -= take;
            }
        }
        if (st_->i == st_->refs.size()) {
            delete st_;
            st_ = nullptr;
        }
    }

    /* Takes back what was appended from byte `size` on (a reply left half-built by an out of
     * memory): the client sees its connection close instead of half a reply. */
    void truncate(size_t size, fe_kvmap &kv) {
        drop_refs(size, kv);
        bytes.resize(size);
    }

    /* All sent: empties the buffer, giving its memory back when it grew above keep. */
    void reset_if_sent(size_t keep) {
        if (pos_ != bytes.size() || st_ != nullptr)
            return;
        bytes.clear();
        pos_ = 0;
        if (bytes.capacity() > keep)
            std::string().swap(bytes);
    }

    /* Unpins every value not sent yet and frees everything (the connection is closing). */
    void release(fe_kvmap &kv) {
        drop_refs(0, kv);
        std::string().swap(bytes);
        pos_ = 0;
    }

  private:
    struct ref {
        size_t at;         /* the value goes out after bytes[0:at] */
        fe_entry *e;
    };
    struct streamed {      /* allocated while some value is streamed */
        std::vector<ref> refs;
        size_t i = 0;      /* refs[0:i] are sent (and unpinned) */
        size_t off = 0;    /* bytes of refs[i]'s value sent */
        size_t unsent = 0; /* bytes of the values not sent yet */
    };

    /* Unpins the unsent values placed after byte `after` (0: all of them). */
    void drop_refs(size_t after, fe_kvmap &kv) {
        if (st_ == nullptr)
            return;
        while (st_->refs.size() > st_->i && (after == 0 || st_->refs.back().at > after)) {
            fe_entry *e = st_->refs.back().e;
            st_->unsent -= e->vlen - (st_->refs.size() - 1 == st_->i ? st_->off : 0);
            kv.unpin(e);
            st_->refs.pop_back();
        }
        if (st_->refs.size() == st_->i) {
            delete st_;
            st_ = nullptr;
        }
    }

    size_t pos_ = 0;
    streamed *st_ = nullptr;
};

/* The server's bounds on connection buffers. */
struct fe_budget {
    size_t max_unsent = 0;   /* a connection with more unsent reply bytes is not read... */
    size_t limit = 0;        /* all connections' buffers together */
    size_t held = 0;         /* what they hold now: the sum of every connection's `counted` */

    /* ...until they drain to half of it. */
    bool should_pause(const fe_outbuf &o) const { return o.unsent() > max_unsent; }
    bool may_resume(const fe_outbuf &o) const { return o.unsent() <= max_unsent / 2; }

    /* A connection's buffers now hold `now` bytes; `counted` is what it was counted for. */
    void recount(size_t &counted, size_t now) {
        held = held - counted + now;
        counted = now;
    }
    bool over(size_t elsewhere) const { return held + elsewhere > limit; }
};

#endif
